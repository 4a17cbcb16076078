"""The engine: requests, continuous-batching scheduler over the prefix cache, runner, sampler."""
