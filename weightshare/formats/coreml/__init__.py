"""Core ML ML Program packages (.mlpackage): weight.bin re-layout (convert) and streaming multifunction merge."""
