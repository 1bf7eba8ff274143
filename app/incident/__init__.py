"""Incident tools: replay requests from the log or a trace, export and import traces.

    phasegate replay REQUEST_ID | TRACE.jsonl | --since …     app/incident/commands.py
    phasegate trace export … / trace import FILE               app/incident/trace_io.py

``describe`` and ``timeline`` are pure (events in, text out); ``bulk`` and
``trace_io`` talk to PostgreSQL through :mod:`app.store.queries`. See docs/incidents.md.
"""
