"""vLLM's benches: the A/B of its offload handlers (:mod:`.ab`) and the engine-shaped
sweep (:mod:`.sweep`). Importing this package imports neither vLLM nor ``kvcore_vllm``;
its modules do, and are imported only when a vLLM bench is asked for
(``kvcore bench --engine vllm --sweep``, ``scripts/vllm_ab.sh``)."""
