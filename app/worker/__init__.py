"""The replica process: one engine behind a lease-enforcing HTTP protocol (DESIGN.md §7)."""
