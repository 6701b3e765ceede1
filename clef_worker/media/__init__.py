"""Images and videos in the model: pixels prepared as the release's processor does, then the
vision tower and the media tokens it feeds the text stack.

Decoding and the request-level checks live in `clef_protocol.media` (the front runs them too);
this package starts from decoded 8-bit RGB frames and needs torch.

| module | job |
|---|---|
| `pixels` | decoded frames → resized, normalised patch rows (Pillow and torch, no torchvision) |
| `vision` | the vision tower, the media tokens and the multimodal rotary positions |
"""
