"""The kernel conformance suite: Scope's 40 scenarios (scope-kernel.md §10), adapted to appends."""
