from gradloc.exporters.jsonl import JsonlSink, read_incidents

__all__ = ["JsonlSink", "read_incidents"]
