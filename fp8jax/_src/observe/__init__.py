"""Observers on top: the inspector (what runs on FP8 tensor cores), the cost model and
telemetry. They read compiled programs and layers; nothing below imports them."""
