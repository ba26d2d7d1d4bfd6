"""longboat.xpu: Kunlun XPU accelerator plugin."""
