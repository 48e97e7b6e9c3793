"""One line per package the bench scripts depend on, with its version (for machine.txt)."""

import importlib

for name in ("torch", "transformers", "torchao", "cut_cross_entropy", "liger_kernel", "triton"):
    try:
        module = importlib.import_module(name)
    except Exception as exc:
        print(f"{name}: not importable ({type(exc).__name__})")
        continue
    extra = f" cuda {module.version.cuda}" if name == "torch" else ""
    print(f"{name} {getattr(module, '__version__', '?')}{extra}")
