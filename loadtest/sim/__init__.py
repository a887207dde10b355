"""A simulator of SGLang servers: SGLang's HTTP API over a continuous-batching engine model."""
