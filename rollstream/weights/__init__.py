"""The weight store: a policy's weights published as param versions on `params` and fetched by producers.
`store` (publish, fetch, pins, GC; inline, file:// and Redis-chunk transports), `chunks` (the Redis-chunk
transport), `tensors` (every weights <-> bytes conversion: safetensors in memory and streamed files) and
`fingerprint` (the swap check's probe: does a loaded engine hold the version it stamps)."""
