"""The worker tests' shared fixtures (defined with the daemon tests)."""

from tests.workers.test_daemon import broker_url, daemons, env, ledger

__all__ = ["broker_url", "daemons", "env", "ledger"]
