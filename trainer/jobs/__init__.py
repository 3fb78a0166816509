"""The job machinery: job records, the in-process and Redis queues, the runner, the `skillpool worker` process.

The server takes what it needs through skillpool.trainer.service, never from these modules.
"""
