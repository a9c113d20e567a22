"""The LightningCLI entry point of ``examples/lightningcli.yaml`` (Lightning's BoringModel with bitsandbytes
AdamW8bit; the callback comes from the YAML).

Run: ``python examples/lightningcli_main.py fit --config examples/lightningcli.yaml``
"""

from __future__ import annotations

import bitsandbytes as bnb
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.demos.boring_classes import BoringModel


class BoringWith8bitStates(BoringModel):
    def configure_optimizers(self):
        return bnb.optim.AdamW8bit(self.parameters(), lr=1e-3, min_8bit_size=16)


def main(args: list[str] | None = None) -> LightningCLI:
    return LightningCLI(BoringWith8bitStates, args=args, save_config_callback=None)


if __name__ == "__main__":
    main()
