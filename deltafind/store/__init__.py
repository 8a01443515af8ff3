"""The read path of an expert store: manifest, readers, drive queues, cache, prefetch, resident layers,
heat and traces. What writes a store is `deltafind.importer`, which this package never imports."""
