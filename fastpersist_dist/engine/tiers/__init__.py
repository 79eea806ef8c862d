"""Tiered checkpoints: each node's local tier at device speed, replicas on other nodes, the persistent tier in the
background (docs/tiers.md).

``save`` (the local commit, then the background work), ``replicate`` and ``drain`` (that work, on the threads of
``background``), ``state`` (how far a checkpoint got, and the API to ask or wait), ``copies`` (where a load reads),
``retention`` (which local copies stay), ``removal`` (a framework's removal of a checkpoint, once nothing durable
is lost), ``topology`` (nodes, failure domains, the replication group).
"""
