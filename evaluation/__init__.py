"""The client side of skillpool: `skillpool eval`, `skillpool upload`, and a server run as a child process.

routing     learn tasks one by one into a fresh router and measure routing after each (no LLM)
continual   learn a task sequence through a real server; score matrix, AP, F.Ra, FWT, BWT, baselines
            (continual_sequence: the server side; continual_resume: --resume; continual_task: a task;
            continual_metrics, continual_report; baselines: seq, mtl and trained alone; progress_log)
answers     a skill's answers under four wordings of its task (uploaded, paraphrase, system message, input
            only), forced and routed, with paired bootstrap gaps (answers_variants, answers_report)
run_options the flags and result's config block continual and answers share (training through a server)
tasks       the one reader of task folders (train.jsonl, test.jsonl), the SKILLPOOL_DATASETS setting and the
            packaged instruction paraphrase sets (paraphrases/)
tasks_client the one client of /tasks: upload, follow with progress, wait, cancel (upload, continual, the
            benchmarks and the end-to-end tests)
upload      `skillpool upload`: send a task file to a running server and follow its job
process     start `skillpool serve` as a child process (drivers, benchmarks, end-to-end tests)

It sits on top of the server: it drives the product over HTTP as a user would. Answer scoring (exact match,
ROUGE-L, greedy generation) stays in trainer.scoring: the trainer's quality gate uses it too.
"""
