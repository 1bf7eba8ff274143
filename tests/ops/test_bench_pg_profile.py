"""``ops/bench/pg_profile.py`` reads ``perf script``'s samples and counts each part of
PostgreSQL's work inclusively, the trigger's share apart from the log's own rows."""

from __future__ import annotations

from ops.bench.pg_profile import profile, stacks_of

# perf script's default output: a header line a sample, its frames innermost first, a blank line
SCRIPT = """\
postgres 101 64158.484388:     500250 cpu-clock:
\t          5abdd3 _bt_compare+0x3 (/usr/lib/postgresql/bin/postgres)
\t          3bee65 ExecInsertIndexTuples+0x35 (/usr/lib/postgresql/bin/postgres)
\t          3bf91c ExecInsert+0x6c (/usr/lib/postgresql/bin/postgres)
\t          37c10d PostgresMain+0x25d (/usr/lib/postgresql/bin/postgres)

postgres 101 64158.484888:     500250 cpu-clock:
\t          5abdd4 ExecInitExprRec+0x3 (/usr/lib/postgresql/bin/postgres)
\t          3bee66 standard_ExecutorStart+0x35 (/usr/lib/postgresql/bin/postgres)
\t          3bee67 exec_stmts+0x35 (/usr/lib/postgresql/plpgsql.so)
\t          3bf91d AfterTriggerEndQuery+0x6c (/usr/lib/postgresql/bin/postgres)
\t          3bf91e ExecInsert+0x6c (/usr/lib/postgresql/bin/postgres)
\t          37c10e PostgresMain+0x25d (/usr/lib/postgresql/bin/postgres)

postgres 102 64158.485388:     500250 cpu-clock:
\t ffffffff8a0 ext4_sync_file+0x1 ([kernel.kallsyms])
\t          5abdd5 XLogFlush+0x3 (/usr/lib/postgresql/bin/postgres)
\t          37c10f PostgresMain+0x25d (/usr/lib/postgresql/bin/postgres)

postgres 102 64158.485888:     500250 cpu-clock:
\t          5abdd6 _bt_compare+0x3 (/usr/lib/postgresql/bin/postgres)
\t          3bf91f ExecUpdate+0x6c (/usr/lib/postgresql/bin/postgres)
\t          3bf920 AfterTriggerEndQuery+0x6c (/usr/lib/postgresql/bin/postgres)
\t          37c110 PostgresMain+0x25d (/usr/lib/postgresql/bin/postgres)
"""


def test_each_sample_is_its_frames_innermost_first() -> None:
    stacks = list(stacks_of(SCRIPT.splitlines(keepends=True)))
    assert [stack[0] for stack in stacks] == ["_bt_compare", "ExecInitExprRec", "ext4_sync_file", "_bt_compare"]
    assert stacks[2] == ["ext4_sync_file", "XLogFlush", "PostgresMain"]


def test_the_parts_are_counted_inclusive_and_the_triggers_rows_apart_from_the_logs() -> None:
    found = profile(stacks_of(SCRIPT.splitlines(keepends=True)))
    shares = dict(found.parts)
    assert found.samples == 4
    assert shares["the projection trigger"] == 0.5  # samples 2 and 4
    assert shares["- setting up its statements"] == 0.25
    assert shares["- its row updates"] == 0.25
    assert shares["the log's rows going in"] == 0.25  # sample 1: sample 2's ExecInsert is under the trigger
    assert shares["- their index entries"] == 0.25
    assert shares["the commit's WAL flush"] == 0.25
    assert shares["planning a statement again"] == 0.0
    assert found.running[0] == ("_bt_compare", 0.5)
