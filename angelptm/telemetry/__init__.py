"""Telemetry: throughput, TFLOPS and memory metrics with their sinks (``monitor``), and one step's trace as
Chrome/Perfetto JSON and a PNG timeline (``step_trace``, ``trace_png``)."""
