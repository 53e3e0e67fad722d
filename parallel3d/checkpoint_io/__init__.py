"""Layout-free checkpoint state: what each rank writes and reads, DCP planners, the async writer,
HF export and import. The step-directory protocol (atomic commit, all-rank agreement,
keep-last-K, finding a checkpoint to resume) is ``parallel3d.checkpoint``.

| module | what |
|---|---|
| ``boxes`` | a flat range of a tp-local (experts: etp-local) tensor -> rectangular boxes of the global tensor |
| ``pieces`` | keys, and this rank's pieces to write / to read as views of its optimizer state |
| ``planners`` | ``torch.distributed.checkpoint`` planners over pieces |
| ``state`` | ``write_state`` / ``read_state`` (collective), ``read_tensors`` (one process) |
| ``writer`` | ``CheckpointWriter``: host staging, one background save at a time, commit |
| ``resume`` | what the trainer saves and restores |
| ``compat`` | format and model-shape checks (one-line errors) |
| ``hf_export`` / ``hf_init`` | transformers directory out of a checkpoint / into a run |
"""
