"""LabError: what went wrong on which rank, in a few lines a notebook can show.

ipyparallel reports remote failures as a CompositeError with one full traceback per engine;
for n ranks that fail the same way that is n screens of the same text. A LabError says once
which ranks failed with which error, keeps the tracebacks on `.failures` for whoever wants
them, and says what to do next.
"""

from __future__ import annotations


class LabError(RuntimeError):
    """A Lab call failed on the engines. `.failures`: one dict per failed rank (rank, engine, host,
    error, traceback)."""

    def __init__(self, message: str, failures: list[dict] | None = None):
        super().__init__(message)
        self.failures = failures or []

    def tracebacks(self) -> str:
        """The remote tracebacks, one per failed rank (ANSI colours included, as ipyparallel sends them)."""
        return "\n\n".join(
            f"--- rank {f.get('rank', '?')} (engine {f.get('engine', '?')}) ---\n{f.get('traceback') or f['error']}"
            for f in self.failures
        )


def describe_failures(what: str, failures: list[dict], *, collective_timeout_s: float | None = None) -> str:
    """One line per distinct error, naming the ranks and engines that raised it."""
    by_error: dict[str, list[dict]] = {}
    for failure in failures:
        by_error.setdefault(failure["error"], []).append(failure)
    lines = [f"lab.{what} failed:"]
    for error, rows in by_error.items():
        ranks = ", ".join(str(r.get("rank", "?")) for r in rows)
        engines = ", ".join(str(r["engine"]) for r in rows)
        hosts = sorted({r["host"] for r in rows if r.get("host")})
        where = f"{'ranks' if len(rows) > 1 else 'rank'} {ranks} (engine{'s' if len(rows) > 1 else ''} {engines}" + (
            f" on {', '.join(hosts)})" if hosts else ")"
        )
        lines.append(f"  {where}: {error}")
    texts = " ".join(by_error)
    died = "died" in texts or "is gone" in texts
    if died:
        lines.append("An engine's process ended (a crash, os._exit, or the out-of-memory killer).")
    if collective_timeout_s is not None:
        lines.append(
            f"A rank that does not answer is usually waiting in a collective for a rank that failed or "
            f"died; collectives give up after {collective_timeout_s:g} s."
        )
    if died or collective_timeout_s is not None:
        lines.append("lab.restart() starts fresh engines and reloads the last pipeline.")
    if any(f.get("traceback") for f in failures):
        lines.append("The remote tracebacks: error.tracebacks().")
    return "\n".join(lines)
