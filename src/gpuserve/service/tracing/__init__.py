"""Request traces, their settings (Triton's trace and log settings) and the OpenTelemetry sink."""
