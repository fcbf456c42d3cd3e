"""Seeing a step before running it: the collectives predicted from the notation (step_comms),
the memory, communication and roofline of a step on a chip (planner), and `seqshard show`."""
