"""Generate the checked-in gRPC stubs of src/vgpu/k8s/protos/*.proto (needs grpcio-tools).

    python tools/gen_protos.py [OUT_DIR]

Without OUT_DIR the stubs are written next to the .proto files; tests/k8s/test_k8s_protos.py
generates into a temporary directory and compares, so stubs never drift from the protos.
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(os.path.dirname(HERE), "src")
PROTOS = os.path.join("vgpu", "k8s", "protos")


def generate(out_root=SRC):
    from grpc_tools import protoc
    os.makedirs(os.path.join(out_root, PROTOS), exist_ok=True)
    names = sorted(f for f in os.listdir(os.path.join(SRC, PROTOS)) if f.endswith(".proto"))
    for name in names:
        rc = protoc.main(["protoc", f"-I{SRC}", f"--python_out={out_root}", f"--grpc_python_out={out_root}",
                          os.path.join(SRC, PROTOS, name)])
        if rc:
            raise SystemExit(f"protoc failed on {name} (exit {rc})")
    return names


if __name__ == "__main__":
    print("generated:", ", ".join(generate(sys.argv[1] if len(sys.argv) > 1 else SRC)))
