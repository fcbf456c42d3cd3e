"""The notation core: shape specs and their parser (notation), shape scopes and block axes
(shapecheck), replication types (vma), typed arrays and ``typed_shard_map`` (shardtypes), the
checked per-device ops (shardops) and the collective each logs (collective_log), and reading
compiled HLO back: its collectives (comms) and the ones that may run out of order
(collective_order); text tables (tables). Nothing here knows the model."""
