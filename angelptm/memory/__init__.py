"""Does it fit: ZeRO-Cache's plan asked before the model is built (``fit_check``), ``pretrain.py --plan's table
(``plan_report``), and a device out-of-memory explained with the settings that would help (``oom``)."""
