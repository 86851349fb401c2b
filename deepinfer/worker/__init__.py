"""Device-side execution: the model runner and the sampler."""
