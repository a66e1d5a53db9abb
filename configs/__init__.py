"""Named presets (data only), installed as `jengine.configs`."""
