"""A raw device address. No destructor: memory is freed by the code that owns it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class DevicePtr:
    addr: int

    def offset(self, nbytes: int) -> DevicePtr:
        if self.addr == 0:
            raise ValueError("offset of a null DevicePtr")
        return DevicePtr(self.addr + int(nbytes))

    def __int__(self) -> int:
        return self.addr

    def __bool__(self) -> bool:
        return self.addr != 0

    def __repr__(self) -> str:
        return f"DevicePtr(0x{self.addr:x})"


NULL = DevicePtr(0)
