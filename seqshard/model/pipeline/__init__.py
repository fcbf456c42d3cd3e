"""Pipelining over the mesh axis p: the timetables of gpipe, circular and 1f1b (schedule),
those timetables as one SPMD program of ticks and ring shifts (spmd), and the model's layers
run through them (pipelined)."""
