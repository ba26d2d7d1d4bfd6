"""longboat.xpu: Kunlun XPU accelerator plugin (registered via the ``longboat.accelerators``
entry point; select it with ``LONGBOAT_ACCELERATOR=xpu``)."""
