"""Benchmarks of memledger, each printed beside a baseline measured in the same run.

Run them all with `make bench` (`python -m bench`), one with `python -m bench.append`
or `python -m bench --only append`. Every module exposes `async def run() -> list[dict]`;
`bench.common` holds the shared helpers (sizes, temp directories, raw sqlite3, results).
"""
