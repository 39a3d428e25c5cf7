"""Live progress for a run: sent, ok, dropped, in flight, current rates (rich, redrawn at 2 Hz).

On a terminal a rich ``Live`` panel is redrawn in place; otherwise (CI logs, pipes) a plain line
is printed every ``every_s`` seconds so logs stay readable.
"""

from __future__ import annotations

import time

from rich.console import Console
from rich.live import Live
from rich.table import Table

from usefulwork.loadtest.runner import Counters


class LiveProgress:
    def __init__(self, title: str, console: Console | None = None, every_s: float = 10.0,
                 planned_s: float | None = None) -> None:
        self.title = title
        self.console = console or Console(stderr=True)
        self.every_s = every_s
        self.planned_s = planned_s
        self._live: Live | None = None
        self._last_print = 0.0

    def _table(self, c: Counters) -> Table:
        sent_rate, ok_rate = c.rate()
        elapsed = time.perf_counter() - c.started
        t = Table(title=self.title, show_header=True, header_style="bold", expand=False)
        for col in ("elapsed", "sent", "ok", "dropped", "in flight", "send rate", "ok rate", "tokens"):
            t.add_column(col, justify="right")
        span = f"{elapsed:5.0f}s" + (f"/{self.planned_s:.0f}s" if self.planned_s else "")
        t.add_row(span, str(c.sent), f"[green]{c.ok}", f"[red]{c.dropped}" if c.dropped else "0", str(c.in_flight),
                  f"{sent_rate:.2f}/s", f"{ok_rate:.2f}/s", str(c.output_tokens))
        return t

    def __enter__(self) -> "LiveProgress":
        if self.console.is_terminal:
            self._live = Live(console=self.console, refresh_per_second=2, transient=False, auto_refresh=False)
            self._live.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._live is not None:
            self._live.__exit__(*exc)
            self._live = None

    def __call__(self, c: Counters) -> None:
        if self._live is not None:
            self._live.update(self._table(c), refresh=True)
            return
        now = time.perf_counter()
        if now - self._last_print >= self.every_s:
            self._last_print = now
            sent_rate, ok_rate = c.rate()
            self.console.print(
                f"[{self.title}] {now - c.started:6.0f}s sent={c.sent} ok={c.ok} dropped={c.dropped} "
                f"in_flight={c.in_flight} send_rate={sent_rate:.2f}/s ok_rate={ok_rate:.2f}/s", highlight=False, soft_wrap=True)
