"""Tiered checkpoints: each node's local tier, replicas on other nodes, the persistent tier in the background
(docs/tiers.md, docs/design.md "Tiers")."""

