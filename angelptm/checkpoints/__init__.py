"""Checkpoints: the files and their atomic protocol (``files``), manifests (``manifest``), safe unpickling
(``safe_pickle``), what the engine saves and loads (``engine_state``), the model architecture record
(``architecture``) and offline export to safetensors / Hugging Face (``export``, ``hf_export``)."""
