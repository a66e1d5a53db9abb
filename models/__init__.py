"""Model families for jengine (installed as `jengine.models`)."""
