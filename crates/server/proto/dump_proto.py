"""Prints the tinker_public .proto rebuilt from the descriptor embedded in the SDK."""
from google.protobuf import descriptor_pb2
from tinker.proto import tinker_public_pb2 as pb

fd = descriptor_pb2.FileDescriptorProto()
fd.ParseFromString(pb.DESCRIPTOR.serialized_pb)
T = descriptor_pb2.FieldDescriptorProto
names = {v: k[5:].lower() for k, v in T.Type.items()}
out = [f'syntax = "{fd.syntax or "proto2"}";', f"package {fd.package};", ""]

def ftype(f):
    if f.type in (T.TYPE_MESSAGE, T.TYPE_ENUM):
        return f.type_name.rsplit(".", 1)[-1] if f.type_name.startswith("." + fd.package + ".") else f.type_name
    return names[f.type]

def msg(m, ind):
    p = "  " * ind
    out.append(f"{p}message {m.name} {{")
    maps = {n.name: n for n in m.nested_type if n.options.map_entry}
    for e in m.enum_type:
        enum(e, ind + 1)
    for n in m.nested_type:
        if not n.options.map_entry:
            msg(n, ind + 1)
    oneofs = {}
    for f in m.field:
        if f.HasField("oneof_index") and not f.proto3_optional:
            oneofs.setdefault(f.oneof_index, []).append(f)
    done = set()
    for f in m.field:
        if f.HasField("oneof_index") and not f.proto3_optional:
            if f.oneof_index in done:
                continue
            done.add(f.oneof_index)
            out.append(f"{p}  oneof {m.oneof_decl[f.oneof_index].name} {{")
            for g in oneofs[f.oneof_index]:
                out.append(f"{p}    {ftype(g)} {g.name} = {g.number};")
            out.append(f"{p}  }}")
            continue
        t = ftype(f)
        entry = maps.get(f.type_name.rsplit(".", 1)[-1])
        if entry is not None and f.label == T.LABEL_REPEATED:
            k, v = entry.field
            out.append(f"{p}  map<{ftype(k)}, {ftype(v)}> {f.name} = {f.number};")
            continue
        label = "repeated " if f.label == T.LABEL_REPEATED else ("optional " if f.proto3_optional else "")
        out.append(f"{p}  {label}{t} {f.name} = {f.number};")
    out.append(f"{p}}}")

def enum(e, ind):
    p = "  " * ind
    out.append(f"{p}enum {e.name} {{")
    for v in e.value:
        out.append(f"{p}  {v.name} = {v.number};")
    out.append(f"{p}}}")

for e in fd.enum_type:
    enum(e, 0)
for m in fd.message_type:
    msg(m, 0)
    out.append("")
print("// Rebuilt from the file descriptor embedded in the tinker 0.38.0 SDK")
print("// (tinker/proto/tinker_public_pb2.py) by crates/server/proto/dump_proto.py.")
print("\n".join(out))
