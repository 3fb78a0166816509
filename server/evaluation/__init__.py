"""`skillpool eval`: the benchmarks that are part of the product, in one place.

routing     learn tasks one by one into a fresh router and measure routing after each (no LLM)
continual   learn a task sequence through a real server; score matrix, AP, F.Ra, FWT, BWT, baselines
tasks       the one reader of task folders (train.jsonl, test.jsonl) both use

Answer scoring (exact match, ROUGE-L, greedy generation) stays in trainer.scoring: the trainer's
quality gate uses it too, and the trainer may not import the server.
"""
