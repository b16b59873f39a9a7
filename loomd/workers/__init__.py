"""Background memory workers (observer, reflector, dropper, digest, gc) and their scheduler (design §6)."""
