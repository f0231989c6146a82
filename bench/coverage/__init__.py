"""Coverage: which jobs and torch releases the probe estimates, in which mode, and at what cost
(every torch release, the conformance corpus, the fine-tuning matrix, distributed training)."""
