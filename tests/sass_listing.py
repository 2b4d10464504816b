"""Hand-written SASS listings in nvdisasm's format, for the tests of fa_numba.sass and fa_numba.whole_kernel."""


def listing(*lines) -> str:
    """Instruction texts 16 bytes apart from 0x0000, and labels (".L_x_n")."""
    out, address = [], 0
    for text in lines:
        if text.startswith(".L_x_"):
            out.append(f"{text}:")
        else:
            out.append(f"        /*{address:04x}*/                   {text} ;")
            address += 0x10
    return "\n".join(out)
