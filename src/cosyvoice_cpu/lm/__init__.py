"""The speech-token LM at run time: graph session and KV cache, prompt assembly, prefix cache, sampling, the
decode loop, the token filter and the scheduler that batches concurrent requests."""
