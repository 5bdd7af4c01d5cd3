"""Checkpoints: the files and their atomic protocol (``files``), manifests (``manifest``), safe unpickling
(``safe_pickle``), what the engine saves (``engine_save``) and how it loads them (``engine_load``), the model
architecture record (``architecture``) and offline export to safetensors / Hugging Face (``export``, ``hf_export``)."""
