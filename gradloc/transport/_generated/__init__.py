"""GENERATED code of the wire schema — do not edit; regenerate with ``scripts/gen_proto.sh``.

Source: ``proto/gradloc/v1/gradloc.proto`` (protobuf package ``gradloc.v1``). protoc runs with
``-I proto`` and writes here, so the modules land at ``gradloc/v1/gradloc_pb2.py`` below this
package and import as ``gradloc.transport._generated.gradloc.v1.gradloc_pb2``; the script rewrites
protoc's cross-file imports (``from gradloc.v1 import …``) to that absolute package path, so no
``sys.path`` trick is needed and the descriptor names (``gradloc/v1/gradloc.proto``) stay what
other languages see. ``.pyi`` stubs are generated alongside. ``tests/transport/test_generated_code.py``
fails when these files differ from what the script produces. Only this ``__init__.py`` is
hand-written. Use the schema through :mod:`gradloc.transport.wire`.
"""
