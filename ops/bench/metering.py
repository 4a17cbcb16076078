"""Metering write path: sustained usage rows/s through UsageWriter's group commit, and its latency.

Setup: a migrated database (PostgreSQL in a fresh schema, dropped at the end; or, with --sqlite, a
temporary SQLite file in WAL mode) holding one tenant, and a `UsageWriter` with its defaults
(gather for 2 ms, at most 2,000 rows per transaction) and a spool in a temporary folder.

For each concurrency level C (--concurrency, default 256, then 1), C asyncio producers each await
`writer.write(record)` in a closed loop for --seconds, every record with a new request_id. Prints
sustained rows/s, transactions, mean rows per transaction, the latency `write()` adds (p50/p99 ms,
i.e. what a response's last byte waits for) and rows spooled (0 unless the database failed). C = 1
shows a lone request's latency: the 2 ms gather window plus one commit. At the end it checks that
the table holds exactly as many rows as writes were awaited.

Goal (issue): >= 5,000 rows/s sustained into PostgreSQL.

    .venv/bin/python ops/bench/metering.py [--url URL | --sqlite] [--seconds 5] [--concurrency 256]
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

from sqlalchemy import Engine, create_engine, func, select, text

from accounting.db import create_db_engine, session_factory, upgrade_database
from accounting.models import UsageEvent
from accounting.tenants import create_tenant
from accounting.usage import UsageRecord
from accounting.usage_writer import UsageWriter
from ops.bench.http_load import percentile

DEFAULT_URL = "postgresql+psycopg2://postgres@127.0.0.1:5432/test"
GOAL_ROWS_PER_S = 5_000


@dataclass
class Result:
    concurrency: int
    rows: int
    seconds: float
    transactions: int
    spooled: int
    latencies: list[float]

    @property
    def rows_per_s(self) -> float:
        return self.rows / self.seconds


@contextmanager
def postgres_engine(url: str) -> Iterator[Engine]:
    """An engine whose connections live in a fresh schema, dropped afterwards."""
    schema = f"tollway_bench_metering_{uuid.uuid4().hex[:12]}"
    admin = create_engine(url)
    with admin.begin() as connection:
        connection.execute(text(f'CREATE SCHEMA "{schema}"'))
    engine = create_engine(url, pool_pre_ping=True, connect_args={"options": f"-csearch_path={schema}"})
    try:
        yield engine
    finally:
        engine.dispose()
        with admin.begin() as connection:
            connection.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
        admin.dispose()


@contextmanager
def sqlite_engine(folder: Path) -> Iterator[Engine]:
    engine = create_db_engine(f"sqlite:///{folder / 'bench.db'}")
    try:
        yield engine
    finally:
        engine.dispose()


async def produce(writer: UsageWriter, tenant_id: int, prefix: str, deadline: float,
                  latencies: list[float]) -> None:
    """One closed-loop producer: a record, await its write, repeat until the deadline."""
    n = 0
    while time.perf_counter() < deadline:
        finished = datetime.now(UTC)
        record = UsageRecord(
            request_id=f"{prefix}-{n}", tenant_id=tenant_id, model="smollm2-135m-instruct",
            prompt_tokens=120 + n % 50, cached_tokens=64, completion_tokens=30 + n % 20, status="ok",
            finish_reason="stop", ttft_ms=12.5, latency_ms=180.0,
            started_at=finished - timedelta(milliseconds=180), finished_at=finished,
        )
        started = time.perf_counter()
        await writer.write(record)
        latencies.append(time.perf_counter() - started)
        n += 1


async def run_level(engine: Engine, spool: Path, tenant_id: int, concurrency: int, seconds: float,
                    max_delay_s: float) -> Result:
    """C producers for `seconds` against a fresh writer; the writer is closed (flushed) at the end."""
    writer = UsageWriter(engine, spool_path=spool, max_delay_s=max_delay_s)
    writer.start()
    latencies: list[float] = []
    started = time.perf_counter()
    try:
        await asyncio.gather(*(
            produce(writer, tenant_id, f"bench-c{concurrency}-p{i}", started + seconds, latencies)
            for i in range(concurrency)
        ))
        elapsed = time.perf_counter() - started
    finally:
        writer.close()
    stats = writer.stats()
    return Result(concurrency, len(latencies), elapsed, stats.transactions, stats.rows_spooled, latencies)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default=DEFAULT_URL, help="PostgreSQL URL (a fresh schema is made in it)")
    parser.add_argument("--sqlite", action="store_true", help="use a temporary SQLite file instead")
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--max-delay-ms", type=float, default=0.0,
                        help="the writer's gather window (the gateway uses 0: a commit in progress is the window)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="tollway-bench-metering-") as folder:
        backend = sqlite_engine(Path(folder)) if args.sqlite else postgres_engine(args.url)
        with backend as engine:
            upgrade_database(engine)
            with session_factory(engine).begin() as session:
                tenant_id = create_tenant(session, "bench").id
            print(f"metering benchmark: {engine.dialect.name} ({engine.url.render_as_string()}), "
                  f"{args.seconds:g} s per level", flush=True)
            results = [
                asyncio.run(run_level(engine, Path(folder) / f"spool-{c}.jsonl", tenant_id, c, args.seconds,
                                        args.max_delay_ms / 1e3))
                for c in dict.fromkeys((args.concurrency, 1))
            ]
            with engine.connect() as connection:
                in_table = connection.scalar(select(func.count()).select_from(UsageEvent))

    print()
    header = f"{'C':>5} {'rows/s':>9} {'rows':>9} {'transactions':>13} {'rows/tx':>8} " \
             f"{'p50 ms':>7} {'p99 ms':>7} {'spooled':>8}"
    print(header)
    print("-" * len(header))
    for r in results:
        print(f"{r.concurrency:>5} {r.rows_per_s:>9,.0f} {r.rows:>9,} {r.transactions:>13,} "
              f"{r.rows / max(r.transactions, 1):>8.1f} {percentile(r.latencies, 0.5) * 1e3:>7.2f} "
              f"{percentile(r.latencies, 0.99) * 1e3:>7.2f} {r.spooled:>8,}")
    print()
    best = max(r.rows_per_s for r in results)
    verdict = "met" if best >= GOAL_ROWS_PER_S else "NOT met"
    target = "PostgreSQL" if engine.dialect.name == "postgresql" else "PostgreSQL; this run is SQLite"
    print(f"Goal: >= {GOAL_ROWS_PER_S:,} rows/s into {target}: best {best:,.0f} rows/s, {verdict}.")
    awaited = sum(r.rows for r in results)
    check = "OK" if in_table == awaited else "MISMATCH"
    print(f"Rows in usage_events: {in_table:,}; writes awaited: {awaited:,} ({check}).")


if __name__ == "__main__":
    main()
