"""Everything that only measures: each module with a `main(argv)` is a benchmark, run as
`rollstream bench NAME` (NAME = the module name without a trailing `_`: `async_.py` is `rollstream bench
async`); `rollstream bench
--list` lists them. Benchmarks drive the workers (producers, consumers), so this package sits above them."""
