from gradloc.exporters.jsonl import JsonlSink, Sink, read_incidents

__all__ = ["JsonlSink", "Sink", "read_incidents"]
