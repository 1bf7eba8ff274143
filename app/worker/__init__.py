"""The replica process: one engine behind a lease-enforcing HTTP protocol (docs/design.md §7)."""
