"""Integrations of jagflash with libraries that own the model code.

Each submodule imports its library, so it is imported only on request (`import jagflash` never
imports them):

    import jagflash.integrations.transformers as jf_transformers
    jf_transformers.register()   # then attn_implementation="jagflash" in transformers
"""
