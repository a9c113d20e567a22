"""One file per optimizer family the weight write-back takes over (each exports ``FAMILIES``: optimizer class ->
:class:`~lightning_stale.act.writeback.family.Family`), registered once its library is imported."""
