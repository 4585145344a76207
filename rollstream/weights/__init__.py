"""The weight store: a policy's weights published as param versions on `params` and fetched by producers.
`store` (publish, fetch, pins, GC; inline, file:// and Redis-chunk transports), `chunks` (the Redis-chunk
transport) and `tensors` (every weights <-> bytes conversion: safetensors in memory and streamed files)."""
