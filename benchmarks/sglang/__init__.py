"""SGLang's benches: the A/B of its transfer methods (:mod:`.ab`) and the engine-shaped
sweep (:mod:`.sweep`). Importing this package imports neither SGLang nor
``kvcore_sglang``; its modules do, and ``kvcore bench`` imports them only for
``--engine sglang``."""
