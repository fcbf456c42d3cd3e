"""Downstream evaluation: tasks (:mod:`~seqshard.evals.tasks`), their scoring by the sharded
model (:mod:`~seqshard.evals.scoring`), and the task made from the main job's held-out files
(:mod:`~seqshard.evals.stdlib_task`)."""
