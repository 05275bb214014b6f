"""The inference core: scheduler, KV block manager, model runner, sampling, detokenization."""
